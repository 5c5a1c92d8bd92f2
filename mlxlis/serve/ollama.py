"""(placeholder)"""

from fastapi import APIRouter


def router(svc, auth) -> APIRouter:
    return APIRouter()
