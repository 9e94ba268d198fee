from tools.monitorctl.main import main

main()
