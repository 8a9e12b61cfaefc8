"""`python -m cache_service.cli ...`: the `kvcache` command."""

import sys

from cache_service.cli.main import main

sys.exit(main())
