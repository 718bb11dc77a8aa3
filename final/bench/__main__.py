"""`python -m final.bench [--quick] [--json] ...` (the same as `final bench`)."""

import sys

from final.bench.cli import main
from final.cli import quiet

quiet()
sys.exit(main())
