from doctor.cli import main

raise SystemExit(main())
