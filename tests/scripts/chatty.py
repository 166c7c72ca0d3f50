"""Each rank prints many long lines as fast as it can, to stdout and stderr (demux test)."""
import sys

from labutils.dist import rank

r = rank()
for i in range(3000):
    print(f"R{r}-{i:05d}-" + str(r) * 300)
    if i % 10 == 0:
        print(f"E{r}-{i:05d}-" + str(r) * 100, file=sys.stderr)
