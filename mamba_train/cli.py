"""How the command-line tools (scripts/*.py) answer a mistake in what they were asked:
one line naming it, exit 2, before any expensive work, as train.py does.

absl answers a bad flag with two lines (`FATAL Flags parsing error` and a pointer to
--helpshort) and an `app.UsageError` raised in `main` with the tool's whole help (about
50 lines for scripts/generate.py) before the line that matters. `run` replaces
`app.run` for them: a flag that does not parse, a required flag left out, a bound
crossed (`lower_bound=` on the flag), an `app.UsageError` or a `UserError` from `main`
each print `error: <what> (flags: --help)` and exit 2. `--help` still prints the help.
"""

from __future__ import annotations

import gc
import sys

from absl import app, flags

from mamba_train.errors import UserError

# What a flag that does not parse raises: absl's own errors, and for ml_collections'
# --config.key=value overrides (a misspelt key, a value of the wrong type) these.
FLAG_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError)


def fail(message: str, code: int = 2):
  """Print `error: message` on stderr and exit with `code`."""
  text = " ".join(str(message).split())  # one line, whatever the message held
  print(f"error: {text}", file=sys.stderr)
  sys.exit(code)


def _parse(argv):
  try:
    return flags.FLAGS(argv)
  except FLAG_ERRORS as e:
    fail(f"{_flag_message(e)} (flags: --help)")


def _flag_message(e: Exception) -> str:
  text = str(e).replace("\\n", " ").replace("\\'", "'")
  while len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a KeyError's quotes, nested
    text = text[1:-1]
  if isinstance(e, (AttributeError, KeyError)) and text.isidentifier():  # ml_collections: no such key
    return f"the config has no key {text!r} (its keys: configs/base.py)"
  # absl: "flag --model=None: Flag --model must have a value other than None."
  if "must have a value other than None" in text:
    name = text.split("Flag --", 1)[-1].split(" ", 1)[0]
    return f"--{name} is required"
  return text


def freeze_imported() -> None:
  """Take everything imported so far out of the cyclic garbage collector's walks
  (`gc.freeze`): the modules, classes and functions of JAX, Flax, Orbax and the package,
  live for the whole process. Tracing and lowering a step allocate enough to start many
  full collections, each of which would walk them all again (what it saves a short run:
  docs/bench/suite.md). An entry point calls it when its imports are done. Objects
  still free by reference count as before."""
  gc.freeze()


def run(main) -> None:
  """`app.run(main)` with one-line answers to a bad flag or a `UsageError` / `UserError`,
  after `freeze_imported` (the tool's imports are done by then)."""
  freeze_imported()
  def main_one_line(argv):
    try:
      return main(argv)
    except (app.UsageError, UserError) as e:
      fail(f"{e} (flags: --help)" if isinstance(e, app.UsageError) else str(e))
  app.run(main_one_line, flags_parser=_parse)


def must_exist(value: str, flag: str) -> None:
  """Raise `app.UsageError` (one line under `run`) when the path `value` given to `flag`
  (local or gs://) does not exist: said before anything is loaded, and before what
  would be looked for inside it."""
  from mamba_train.workdir import storage  # pylint: disable=import-outside-toplevel
  if not storage.path(value).exists():
    raise app.UsageError(f"{flag} {value} does not exist")
