"""A distillation teacher is admitted only if it reads token ids as the student does: SubmitRun's
preflight compares the two tokenizers' vocabularies and refuses the policy itself as its own teacher."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from rlserve.config import parse_spec
from rlserve.loop.admission import RunAdmission
from rlserve.models import resolve_model
from rlserve.rpc import RpcError


def check(teacher: str, student):
    spec = parse_spec({"grpo": {"adv_estimator": {"name": "on_policy_distillation"}},
                       "teacher": {"model_name": teacher}})
    asyncio.run(RunAdmission._check_teacher(spec, student))


def test_a_teacher_with_the_students_vocabulary_passes_and_another_vocabulary_is_refused(tmp_path):
    student = resolve_model("preset:tiny")
    check("preset:small", student)  # a larger model, the same tokenizer
    other = tmp_path / "other"
    shutil.copytree(student, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"]["9"], tok["model"]["vocab"]["8"] = tok["model"]["vocab"]["8"], tok["model"]["vocab"]["9"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(RpcError) as err:
        check(str(other), student)
    assert "teacher.model_name" in str(err.value) and "tokenizer differs" in str(err.value)
    with pytest.raises(RpcError, match="the policy itself"):
        check("preset:tiny", student)
