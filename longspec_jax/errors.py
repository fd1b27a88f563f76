"""The one exception type the CLIs turn into a one-line message and exit code 2."""


class UserError(Exception):
  """Bad input from the user: a flag, a prompt, a weights file or a model config.

  The message is one sentence that says what is wrong and, where it helps, what to do.
  """
