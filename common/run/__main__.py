from common.run.headless import main

main()
