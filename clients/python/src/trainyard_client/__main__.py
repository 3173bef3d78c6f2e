"""`python -m trainyard_client`: the `trainyard-client` command."""

import sys

from trainyard_client.cli import main

sys.exit(main())
