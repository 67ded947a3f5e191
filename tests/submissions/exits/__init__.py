"""0.1 calls sys.exit(0) on 2 ranks and os._exit(0) on 3 ranks; 0.2 is correct."""
