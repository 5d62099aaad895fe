"""``python -m mtplib.train --out DIR [--minutes M] [--seed S] [--resume]``."""

from mtplib.train.train import main

raise SystemExit(main())
