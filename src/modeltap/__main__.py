from modeltap.cli import main

main()
