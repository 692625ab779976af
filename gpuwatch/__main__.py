from gpuwatch.cli import main

main()
