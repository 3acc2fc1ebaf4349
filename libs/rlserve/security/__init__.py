"""What the public endpoint and the services refuse: tokens and roles, paths outside the
cluster's directories, and reward plug-ins the operator did not allow."""
