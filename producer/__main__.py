"""``python -m producer``."""

from producer.cli import main

main()
