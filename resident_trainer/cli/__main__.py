import sys

from resident_trainer.cli import main

sys.exit(main())
