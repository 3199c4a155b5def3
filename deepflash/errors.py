"""Errors a user can cause. The CLI turns them into one line and exit code 2; the server into 4xx."""


class UserError(Exception):
    """A problem with the user's input (path, model, flag, prompt) that names its fix."""


class NotFound(UserError):
    """A named thing (model, drafter, file) does not exist; the server answers 404."""
