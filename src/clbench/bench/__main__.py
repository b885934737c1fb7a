from clbench.bench.cli import main

main()
