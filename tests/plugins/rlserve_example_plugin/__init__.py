"""A user's package that adds a loss and an advantage estimator to rlserve without editing it.

It is a real distribution: `rlserve_example_plugin-0.1.0.dist-info/entry_points.txt` beside this
folder declares the entries (what `pip install` writes for a package whose pyproject.toml has
`[project.entry-points."rlserve.losses"]`), so any process with `tests/plugins` on its import path
finds it through `importlib.metadata`. A cluster uses it only when its cluster file enables it:

    plugins:
      packages: [rlserve-example-plugin]

and a run names the entries: `loss_fn.name: counted_grpo`, `grpo.adv_estimator.name: centered`.
"""
