"""The two kinds of error an entry point turns into one line instead of a traceback.

`UserError`: what was asked for is wrong (a config field, a data directory, a path, a
checkpoint of another model); the message names the problem and the fix, and the entry
point exits 2. `RunFailure`: a run that started cannot go on (a diverging loss, a save
that failed); the message says why and where the last good checkpoint is, exit 1.

Each concrete error also derives from the builtin it has always been (`ValueError`,
`RuntimeError`, `FileNotFoundError`), so code that catches those keeps working.
This module imports nothing: every layer may raise these.
"""


class UserError(Exception):
  """A mistake in what was asked for; the message says how to fix it."""


class RunFailure(Exception):
  """A started run that cannot continue; the message says why."""
