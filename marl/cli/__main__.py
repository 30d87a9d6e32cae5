from marl.cli.main import main

raise SystemExit(main())
