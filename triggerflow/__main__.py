from triggerflow.cli import main

main()
