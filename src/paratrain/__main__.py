"""`python -m paratrain ...`: the `paratrain` command, for an environment whose scripts are not on PATH."""

from paratrain.launch.cli import main

if __name__ == "__main__":
    main(prog_name="paratrain")
