import sys

from .prepare import main

sys.exit(main())
