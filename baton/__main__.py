from baton.cli.app import main

main()
