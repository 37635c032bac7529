"""What is loaded: model loading, fetching the embedded models, weight prepacking."""
