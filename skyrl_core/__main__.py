from skyrl_core.cli.main import main

main()
