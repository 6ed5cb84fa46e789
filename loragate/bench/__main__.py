from loragate.bench.run import main

raise SystemExit(main())
