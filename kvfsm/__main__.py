import sys

from kvfsm.cli import main

sys.exit(main())
