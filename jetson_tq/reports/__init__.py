"""Product reports: the capacity report (the CLI's ``capacity`` mode, the launcher's sizing) and its plot."""
