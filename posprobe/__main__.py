from posprobe.cli import main

raise SystemExit(main())
