from mobizo.cli import main

raise SystemExit(main())
