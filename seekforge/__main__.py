from seekforge.cli import main

main()
