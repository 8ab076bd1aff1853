"""Parallelism: the device mesh, the logical-axis rules and every sharding built
from them, and joining the processes of a multi-host job."""
