"""The error class of bad config values, apart from the checks, so that any module can raise it
without importing what the checks import."""


class ConfigError(ValueError):
    """A config value is missing or invalid; the message names the key and the fix."""
