from soakd.cli import main

raise SystemExit(main())
