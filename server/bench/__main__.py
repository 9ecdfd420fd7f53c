import sys

from server.bench import main

sys.exit(main())
