from trainer.prepare import main

main()
