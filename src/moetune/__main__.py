import sys

from moetune.cli import main

sys.exit(main())
