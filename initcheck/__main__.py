from initcheck.cli import main

raise SystemExit(main())
