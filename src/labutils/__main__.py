import sys

from labutils.cli import main

sys.exit(main())
