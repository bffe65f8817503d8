"""What a job leaves for people to read: metrics, logs, summaries, progress and plots."""
