"""hami-initcheck's exit codes: the init container's contract with the kubelet and with operators."""

OK = 0  # every check passed (warnings allowed): the plugin may start
FAILED = 100  # a check failed: the plugin could not register; the message says what to fix
USAGE = 2  # bad flags or environment variables (argparse's code)
