"""`python -m kungfu.launcher ...` is `kfrun ...`."""

from . import main

if __name__ == "__main__":
    main()
