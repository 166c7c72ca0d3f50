import sys

from labutils.run.cli import main

sys.exit(main())
