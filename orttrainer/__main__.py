import sys

from orttrainer.cli import main

sys.exit(main())
