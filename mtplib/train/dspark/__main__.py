"""``python -m mtplib.train.dspark --out DIR [--minutes M] [--seed S] [--resume]``."""

from mtplib.train.dspark.train import main

raise SystemExit(main())
