"""Write the configuration reference, docs/configuration.md, from the code it documents
(configs/base.py, Mamba2Config, Runtime and the selection table:
mamba_train/tools/config_reference.py). Run it after changing any of them;
tests/test_docs.py fails until the file is written again.

  python scripts/gen_config_reference.py            # write docs/configuration.md
  python scripts/gen_config_reference.py --check    # exit 1 if the file is out of date
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `configs` lives at the repository root
  sys.path.insert(0, _ROOT)

from absl import flags  # noqa: E402

from configs import base  # noqa: E402
from mamba_train import cli  # noqa: E402
from mamba_train.tools import config_reference  # noqa: E402
from mamba_train.workdir.storage import write_text  # noqa: E402

OUT = os.path.join(_ROOT, "docs", "configuration.md")
_CHECK = flags.DEFINE_bool("check", False, "Only check: exit 1 if the file is out of date.")


def main(argv: list[str]) -> int:
  del argv
  with open(base.__file__, encoding="utf-8") as f:
    text = config_reference.markdown(base.get_config(), f.read())
  if _CHECK.value:
    with open(OUT, encoding="utf-8") as f:
      if f.read() != text:
        print(f"{OUT} is out of date: run python scripts/gen_config_reference.py", file=sys.stderr)
        return 1
    return 0
  write_text(OUT, text)  # atomic: a temporary file renamed
  print(f"wrote {OUT}")
  return 0


if __name__ == "__main__":
  cli.run(main)
