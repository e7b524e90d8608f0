from trainer.hf.cli import main

main()
