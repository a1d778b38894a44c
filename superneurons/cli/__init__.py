"""The command line: superneurons plan | train | bench | demo."""
