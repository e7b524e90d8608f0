"""`python -m trainer.serve`: the serving container's entry point (trainer/serve/cli.py)."""

from trainer.serve.cli import main

if __name__ == "__main__":
    main()
