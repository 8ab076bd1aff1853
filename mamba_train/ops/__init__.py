"""The operations and their kernels: each plain form (the reference, and what runs on
a CPU) beside the kernels that replace it on a chip, and the one table that chooses
among them (`table.py`). Nothing here imports the rest of the package."""
