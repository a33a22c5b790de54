from k3launch.cli import main

main()
