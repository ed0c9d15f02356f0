"""``python -m dracpu`` is the ``dracpu`` command."""

from __future__ import annotations

from dracpu.cli import main

raise SystemExit(main())
