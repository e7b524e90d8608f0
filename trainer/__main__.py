"""`python -m trainer`: the container's entry point."""

from trainer.cli import main

if __name__ == "__main__":
    main(prog_name="python -m trainer")
