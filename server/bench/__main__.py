import sys

from server.bench.cli import main

sys.exit(main())
